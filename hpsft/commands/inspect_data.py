"""Look at what a config will train on, before spending compute on it.

    hpsft inspect-data --config configs/sft.yaml [key=value ...] [--rows 3]

For the first `--rows` conversations of data.train_files: each sequence the row trains (the
chat template applied, data.multiturn and data.truncation too), with the tokens the loss is
taken on marked: green on a terminal, between [[ and ]] otherwise (--color). Then, over the
rows (all of them, or the first --stats-rows): token lengths of the sequences (percentiles
and a histogram), how many rows are over data.max_length and what data.truncation does with
them, the counts of the data stage (rows split, expanded per turn, dropped: docs/data.md),
and how many rows are refused and why. Nothing is written. For a vision-language model
(docs/vision.md) the rows' images are processed as the data stage does and each shown
sequence lists where each image's tokens go (its grid, its run of image tokens).
"""

import dataclasses
import sys
from collections import Counter

from hpsft.commands import command_parser
from hpsft.config import load_config
from hpsft.data.chat_messages import BadRow
from hpsft.data.image_rows import image_layout
from hpsft.data.image_sequences import image_rows_sequences
from hpsft.data.inspection import (COLOR_MARKS, PLAIN_MARKS, compressed_image_pads, image_token_lines, input_files,
                                   length_report, marked_text)
from hpsft.data.row_sequences import OverMaxLength, row_sequences
from hpsft.data.rows import TokenizeOptions
from hpsft.data.shards import read_rows
from hpsft.models.loading import check_model_path, is_vision_language_folder, load_image_processor, load_tokenizer
from hpsft.utils.errors import UserInputError, exits_2_on_user_error


@exits_2_on_user_error
def main(argv=None) -> int:
    parser = command_parser("hpsft inspect-data", __doc__)
    parser.add_argument("--config", default=None, help="YAML config file (e.g. configs/sft.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.max_length=1024")
    parser.add_argument("--rows", type=int, default=3, help="conversations to show (default 3)")
    parser.add_argument("--stats-rows", type=int, default=None, help="rows the statistics cover (default: all)")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="mark supervised tokens in colour (auto: on a terminal) or with [[ ]]")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    opts = TokenizeOptions.from_data_config(config.data)
    tokenizer = load_tokenizer(str(check_model_path(config.model.path, config.model.trust_remote_code)),
                               config.model.trust_remote_code)
    if opts.chat_template is None and tokenizer.chat_template is None:
        raise UserInputError(f"the tokenizer of {config.model.path} has no chat template: name one with "
                             "data.chat_template=<Jinja text or .jinja file>")
    model = config.model
    processor = (load_image_processor(model.path, model.trust_remote_code)
                 if is_vision_language_folder(model.path, model.trust_remote_code) else None)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    marks = COLOR_MARKS if color else PLAIN_MARKS
    # Under data.truncation=error a row over data.max_length stops the run: it is shown and
    # measured as it renders, without a limit.
    unlimited = dataclasses.replace(opts, max_length=sys.maxsize)
    lengths, rows, refused, counts, shown = [], 0, Counter(), Counter(), 0
    for path in input_files(config.data.train_sources()):
        for row_idx, row in enumerate(read_rows(path)):
            if args.stats_rows is not None and rows + sum(refused.values()) >= args.stats_rows:
                break
            try:
                result, patches = sequences_of(row, tokenizer, processor, opts, path)
            except OverMaxLength:
                result, patches = sequences_of(row, tokenizer, processor, unlimited, path)
                counts["over_max_length_rows"] += 1
            except BadRow as err:
                refused[str(err)] += 1
                continue
            rows += 1
            counts.update(result.counts)
            lengths += [len(ids) for ids, _ in result.sequences]
            if shown < args.rows:
                shown += 1
                if result.dropped:
                    print(f"=== {path} row {row_idx}: dropped, {result.dropped}")
                for i, (ids, mask) in enumerate(result.sequences):
                    which = f"sequence {i + 1} of {len(result.sequences)}, " if len(result.sequences) > 1 else ""
                    print(f"=== {path} row {row_idx}: {which}{len(ids)} tokens, {sum(mask)} supervised")
                    text = marked_text(tokenizer, ids, mask, marks)
                    layout = image_layout(processor) if patches is not None else None
                    if layout is not None:
                        text = compressed_image_pads(text, layout.image_token)
                    print(text)
                    if layout is not None and len(patches[i][0]):  # where each image's tokens go
                        print("\n".join(image_token_lines(ids, tokenizer.convert_tokens_to_ids(layout.image_token),
                                                           layout.image_notes(*patches[i]))))
    print("\n".join(length_report(lengths, rows, refused, counts, opts)))
    return 0


def sequences_of(row, tokenizer, processor, opts: TokenizeOptions, path):
    """The row's RowSequences and, with an image processor, each sequence's (pixels, grids)."""
    if processor is None:
        return row_sequences(row, tokenizer, opts), None
    [result] = image_rows_sequences([row], tokenizer, processor, opts, path)
    if isinstance(result, BadRow):
        raise result
    return result.sequences, result.patches


if __name__ == "__main__":
    sys.exit(main())
