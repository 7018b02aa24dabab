"""The renderings of a conversation's prefixes cut from one rendering of the whole, for the
templates whose syntax tree proves that exact.

hpsft/data/chat_tokenize.py locates the supervised turns by rendering prefixes of the
conversation (2k+3 renderings for k supervised turns, each as long as its prefix). Most chat
templates (SmolLM2's and other ChatML ones) are one loop that writes each message on its own:

    HEAD  {% for message in messages %} BODY {% endfor %}  TAIL

If HEAD reads no message but messages[0], BODY only its message, messages[0] and loop.first /
loop.index / loop.index0, TAIL no message but messages[0] and add_generation_prompt only as
the test of an `if`, and nothing anywhere sets a variable, calls a function that could hold
state or reads loop.last / loop.length (which look ahead), then for every n >= 1

    render(messages[:n], gp) == HEAD + BODY(message 0) + ... + BODY(message n-1) + TAIL(gp)

since each of those parts runs on the same inputs in both renderings. So one rendering of the
whole conversation with a marker written where each iteration begins and where the loop ends,
and one of messages[:1] with the generation prompt (for TAIL(True)), give every prefix's
rendering as a slice. `prefix_slicer` proves the shape from the template's syntax tree
(transformers' own Jinja environment parses it); a template it cannot prove, a rendering that
fails or a marker that appears in a message's text leave chat_tokenize to render each prefix.
"""

from functools import lru_cache
from typing import Callable

from jinja2 import TemplateSyntaxError, nodes
from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

# Written where each loop iteration begins and where the loop ends, and cut out again.
MARK = "\x00hpsft-message\x00"

# Expressions whose value depends on their operands alone (no call, no assignment).
PURE_EXPRESSIONS = (nodes.Const, nodes.TemplateData, nodes.Name, nodes.Getitem, nodes.Getattr, nodes.Slice,
                    nodes.Test, nodes.CondExpr, nodes.And, nodes.Or, nodes.Not, nodes.Neg, nodes.Pos,
                    nodes.Compare, nodes.Operand, nodes.Concat, nodes.Add, nodes.Sub, nodes.Mul, nodes.Div,
                    nodes.FloorDiv, nodes.Mod, nodes.Pow, nodes.List, nodes.Tuple, nodes.Dict,
                    nodes.Pair, nodes.Keyword)
PURE_FILTERS = {"trim", "tojson", "string", "upper", "lower", "length", "count", "default", "d", "replace", "join",
                "first", "last", "list", "int", "float", "abs", "capitalize", "title", "items", "round", "indent"}
PURE_METHODS = {"strip", "lstrip", "rstrip", "split", "startswith", "endswith", "lower", "upper", "replace", "title",
                "get", "items", "keys", "values"}
LOOP_FIELDS = {"first", "index", "index0"}  # loop.last, loop.length, loop.nextitem read the following messages


@lru_cache(maxsize=64)
def marked_template(chat_template: str) -> nodes.Template | None:
    """The template's syntax tree with MARK written at each iteration's start and after the loop,
    or None when its shape is not proven (see the module's doc)."""
    try:
        tree = _compile_jinja_template(chat_template).environment.parse(chat_template)
    except TemplateSyntaxError:
        return None  # the exact path reports it
    loops = [i for i, node in enumerate(tree.body) if isinstance(node, nodes.For)]
    if len(loops) != 1:
        return None
    at = loops[0]
    loop = tree.body[at]
    if not (isinstance(loop.target, nodes.Name) and loop.target.name not in ("messages", "loop", "add_generation_prompt")
            and isinstance(loop.iter, nodes.Name) and loop.iter.name == "messages"
            and not loop.else_ and loop.test is None and not loop.recursive):
        return None
    head, tail = tree.body[:at], tree.body[at + 1:]
    if not (all(proven(node, in_loop=False, in_tail=False) for node in head)
            and all(proven(node, in_loop=True, in_tail=False) for node in loop.body)
            and all(proven(node, in_loop=False, in_tail=True) for node in tail)):
        return None
    mark = nodes.Output([nodes.TemplateData(MARK)])
    loop.body.insert(0, mark)
    tree.body.insert(at + 1, mark)
    return tree


def proven(node: nodes.Node, in_loop: bool, in_tail: bool) -> bool:
    """Whether `node` (a statement or expression of HEAD, BODY or TAIL) keeps the shape."""
    if isinstance(node, nodes.Output):
        return all(proven(child, in_loop, in_tail) for child in node.nodes)
    if isinstance(node, nodes.If):
        test_ok = (in_tail and isinstance(node.test, nodes.Name) and node.test.name == "add_generation_prompt") \
            or proven(node.test, in_loop, in_tail)
        return test_ok and all(proven(child, in_loop, in_tail) for child in node.body + node.elif_ + node.else_)
    if isinstance(node, nodes.Name):
        return node.ctx == "load" and node.name not in ("messages", "add_generation_prompt", "loop")
    if isinstance(node, nodes.Getitem) and isinstance(node.node, nodes.Name) and node.node.name == "messages":
        return isinstance(node.arg, nodes.Const) and node.arg.value == 0
    if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) and node.node.name == "loop":
        return in_loop and node.attr in LOOP_FIELDS
    if isinstance(node, nodes.Filter):
        return node.name in PURE_FILTERS and all(proven(child, in_loop, in_tail) for child in node.iter_child_nodes())
    if isinstance(node, nodes.Call):
        # raise_exception only raises (a rendering that raises goes the exact way); the string and
        # dict methods read their object.
        callee = node.node
        if not ((isinstance(callee, nodes.Name) and callee.name == "raise_exception")
                or (isinstance(callee, nodes.Getattr) and callee.attr in PURE_METHODS)):
            return False
        return all(proven(child, in_loop, in_tail) for child in node.iter_child_nodes())
    if isinstance(node, PURE_EXPRESSIONS):
        return all(proven(child, in_loop, in_tail) for child in node.iter_child_nodes())
    return False


def prefix_slicer(chat_template: str, tools, special_tokens: dict,
                  messages: list[dict]) -> Callable[[int, bool], str] | None:
    """rendered(n, add_generation_prompt) for 1 <= n <= len(messages), cut from two renderings;
    None when the template's shape is not proven or the marked renderings do not fit it."""
    tree = marked_template(chat_template)
    if tree is None or not messages:
        return None

    def marked(msgs, add_generation_prompt):
        rendered, _ = render_jinja_template(conversations=[msgs], tools=tools, chat_template=tree,
                                            add_generation_prompt=add_generation_prompt, **special_tokens)
        return rendered[0]

    try:
        whole, first = marked(messages, False), marked(messages[:1], True)
    except Exception:  # noqa: BLE001 - the exact path renders again and reports the template's error
        return None
    parts, first_parts = whole.split(MARK), first.split(MARK)
    if len(parts) != len(messages) + 2 or len(first_parts) != 3 or first_parts[:2] != parts[:2]:
        return None  # a message holds the marker, or the template is not what its tree promised
    starts = [0]  # starts[n]: where message n's text begins; starts[len]: where the loop's ends
    for part in parts[:-1]:
        starts.append(starts[-1] + len(part))
    text = "".join(parts[:-1])
    closing = {False: parts[-1], True: first_parts[-1]}

    def rendered(n: int, add_generation_prompt: bool) -> str:
        return text[: starts[n + 1]] + closing[add_generation_prompt]
    return rendered
