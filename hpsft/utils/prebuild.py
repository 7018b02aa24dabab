"""Build, once, the DeepSpeed op that every first `init_distributed` on CPU would build.

DeepSpeed's CPU accelerator JIT-compiles its shared-memory collective op
(deepspeed_shm_comm, ~1-4 min) at the first process-group set-up. Building it at install
time into $TORCH_EXTENSIONS_DIR keeps that cost out of the first training run and out of
every test that starts ranks. On a GPU machine there is nothing to build.
"""

import torch


def main() -> None:
    if torch.cuda.is_available():
        return
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        builder.load(verbose=False)
        print(f"built {builder.absolute_name()}")


if __name__ == "__main__":
    main()
