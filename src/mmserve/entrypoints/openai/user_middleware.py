"""`--middleware`: ASGI middleware of the operator's own, named by import path (vLLM's flag).

A class is added as Starlette's `app.add_middleware(cls)` adds one (it is called with the app and
wraps it); an async function `(request, call_next) -> response` as `@app.middleware("http")`. They
sit outermost, outside the CORS headers, the access log and the API key, as vLLM puts them: one sees
every request, a refused one too. The path is imported when the flags are read, so a wrong one
stops the start before the model loads.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI


def load_middleware(path: str) -> Any:
    """The class or async function at `path` ("package.module.name"); a ValueError naming the flag
    when it cannot be imported or is neither."""
    module_name, _, name = path.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"--middleware {path!r}: give an import path, package.module.name")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises as it runs
        raise ValueError(f"--middleware {path!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") \
            from None
    target = getattr(module, name, None)
    if target is None:
        raise ValueError(f"--middleware {path!r}: {module_name!r} has no {name!r}")
    if not (inspect.isclass(target) or inspect.iscoroutinefunction(target)):
        raise ValueError(f"--middleware {path!r}: must be an ASGI middleware class or an async function "
                         f"(request, call_next); got {type(target).__name__}")
    return target


def add_user_middleware(app: FastAPI, paths: list[str]) -> None:
    """Add each of `paths`' middleware to `app`, the first given innermost (as vLLM adds them)."""
    for path in paths:
        target = load_middleware(path)
        if inspect.isclass(target):
            app.add_middleware(target)  # type: ignore[arg-type]  # any ASGI middleware class; checked when called
        else:
            app.middleware("http")(target)
