"""Make PyPI's torchvision 0.28.0 importable beside the CPU build of torch 2.13.0 (run with the engine venv's python).

Why: SGLang imports ``torchvision.transforms`` at start-up (multimodal configs), even for a text-only model.
PyPI only has the CUDA build of torchvision for Linux x86_64; its C++ extension ``_C.so`` needs
``libtorch_cuda.so``/``libc10_cuda.so``, which the CPU torch wheel does not ship, so the extension does not load
(torchvision already tolerates that: ``torchvision.extension._has_ops()`` returns False and every
``@register_meta`` op is skipped). Two registrations, ``torch.library.register_fake("torchvision::nms")`` and
``("torchvision::qnms")``, are unconditional, and registering a fake for an operator that was never defined
raises, so ``import torchvision`` dies. A CPU build of torchvision is only on download.pytorch.org, which this
machine kind cannot reach.

What: guard exactly those two decorators with ``_has_ops()``. Nothing else changes; the ops that need ``_C``
(nms, roi_align, ...) are unavailable either way and SGLang's text path never calls them. The patch is
idempotent (a marker comment is checked) and refuses to run if the file does not look as expected.

Usage: ENGINE_VENV/bin/python patch_torchvision.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MARKER = "# radixgate: register_fake guarded by _has_ops() (CPU torch)"
TARGETS = (
    '@torch.library.register_fake("torchvision::nms")',
    '@torch.library.register_fake("torchvision::qnms")',
)
GUARDED = "@(torch.library.register_fake({op}) if torchvision.extension._has_ops() else (lambda fn: fn))"


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        print("patch_torchvision: torchvision is not installed in this interpreter", file=sys.stderr)
        return 1
    path = Path(next(iter(spec.submodule_search_locations))) / "_meta_registrations.py"
    text = path.read_text()
    if MARKER in text:
        print(f"patch_torchvision: already patched ({path})")
        return 0
    for target in TARGETS:
        if text.count(target) != 1:
            print(
                f"patch_torchvision: expected exactly one {target!r} in {path}; not patching", file=sys.stderr
            )
            return 1
        op = target[len("@torch.library.register_fake(") : -1]
        text = text.replace(target, GUARDED.format(op=op))
    path.write_text(f"{MARKER}\n{text}")
    # drop a stale bytecode cache so the next import compiles the patched source
    for pyc in (path.parent / "__pycache__").glob("_meta_registrations.*.pyc"):
        pyc.unlink()
    print(f"patch_torchvision: patched {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
