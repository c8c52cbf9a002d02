"""onnxruntime-genai's model builder, run on configs as transformers 5 writes them, in this process.

`build(arguments)` runs the builder's own command line (`python -m onnxruntime_genai.models.builder
<arguments>`) in the calling process, after one adaptation: transformers 5 keeps the RoPE
parameters of models with sliding and global layers per layer type (`rope_parameters:
{"full_attention": {...}, "sliding_attention": {...}}`, Gemma 3), where the builder (0.18) reads one
flat dict and, for the local layers, `rope_local_base_freq`. The global layers' dict becomes the
flat one and the sliding layers' theta the local frequency; a config already flat is left as it is.
Nothing else changes, and the export is checked against torch's greedy tokens like any other.

In process, not a subprocess per export: the builder's imports (every family's transformers
modules, about 7 s on a 2-core CPU) are paid once per process, not once per precision.
`python -m pruneops.runtimes.genai.builder_main <arguments>` runs it on its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

_LOCK = threading.Lock()  # the builder's command line and output go through sys.argv and fds 1, 2: one build at a time


def _flatten_rope_per_layer_type(config: object) -> None:
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_type" in params or "full_attention" not in params:
        return
    config.rope_parameters = dict(params["full_attention"])
    sliding = params.get("sliding_attention")
    if sliding is not None and getattr(config, "rope_local_base_freq", None) is None:
        config.rope_local_base_freq = sliding["rope_theta"]


def _patch_builder() -> None:
    import onnxruntime_genai.models  # noqa: F401 - puts the builder's folder on sys.path, as the builder does
    from builders import base  # the module object the builder itself imports (not ...models.builders.base)

    original = base.Model.make_rope_init
    if getattr(original, "flattens_rope_per_layer_type", False):
        return

    def make_rope_init(self: object, config: object) -> None:
        _flatten_rope_per_layer_type(config)
        original(self, config)

    make_rope_init.flattens_rope_per_layer_type = True
    base.Model.make_rope_init = make_rope_init


def build(arguments: list[str], log: Path | None = None) -> None:
    """Runs the builder's command line with `arguments` (`-i <folder> -o <out> -p <precision> -e cpu`).

    Args:
        arguments: The builder's command-line arguments.
        log: Where its output goes (Python's and the libraries': file descriptors 1 and 2); None: as it is.

    Raises:
        SystemExit: The builder's argument parser refused `arguments`.
        Exception: Whatever the builder raised on the model.
    """
    with _LOCK, contextlib.ExitStack() as stack:
        stack.enter_context(_root_logging_kept())
        if log is not None:
            stack.enter_context(_output_to(stack.enter_context(Path(log).open("w"))))
        _patch_builder()
        saved = sys.argv
        sys.argv = ["builder.py", *arguments]
        try:
            runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
        finally:
            sys.argv = saved


@contextlib.contextmanager
def _root_logging_kept() -> Iterator[None]:
    """The root logger's handlers and level as they were before the builder ran.

    onnxruntime's MatMulNBits quantizer (the builder's INT8/INT4) calls `logging.basicConfig` when first
    imported: inside `_output_to` that handler writes to the builder's log, closed when the build
    ends, and every later log line of the process (PruneOps' progress included) failed on it.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)


@contextlib.contextmanager
def _output_to(handle: object) -> Iterator[None]:
    """Standard output and error, Python's and the libraries' (file descriptors 1 and 2), go to `handle`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(handle.fileno(), 1)
    os.dup2(handle.fileno(), 2)
    try:
        with contextlib.redirect_stdout(handle), contextlib.redirect_stderr(handle):
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        handle.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


if __name__ == "__main__":
    build(sys.argv[1:])
