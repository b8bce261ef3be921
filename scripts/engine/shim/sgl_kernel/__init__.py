"""CPU-development compatibility shim for ``sgl_kernel`` -- NOT the real package.

SGLang's CPU path (``SGLANG_USE_CPU_ENGINE=1``) imports names from ``sgl_kernel`` at start-up, but the CPU
build of that package is not published on PyPI. With ``--attention-backend torch_native`` and a Llama model
none of those functions is ever called, so this import-only stand-in lets the server start on a machine
without a GPU. Every attribute is a function that raises if called, so a code path that really needs a
kernel fails loudly instead of computing garbage.

radixgate puts ``scripts/engine/shim`` on the PYTHONPATH of the SGLang worker process only when running on
CPU (development / CI). It must never be on the path of a GPU worker, which uses the real ``sgl-kernel``.
"""

from typing import Any, NoReturn

__version__ = "0.0.0+radixgate-cpu-shim"
__path__: list[str] = []  # a package, so "import sgl_kernel.x" resolves to __getattr__ lookups below


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def _unavailable(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is radixgate's CPU import-only shim "
            "(scripts/engine/shim); use the real sgl-kernel on GPU"
        )

    _unavailable.__name__ = _unavailable.__qualname__ = name
    return _unavailable
