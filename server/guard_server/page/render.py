"""The pages as HTML: Jinja2 templates with every value escaped, one inline stylesheet allowed
by its hash, and a Content-Security-Policy that allows nothing else (no script at all, inline
or not: a message that got past the escaping still could not run)."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.responses import HTMLResponse

from guard_server.page.sizes import TOOLTIP, visible
from guard_server.page.views import plural

__all__ = ["CSP", "REFRESH_S", "page"]

_HERE = Path(__file__).parent
_CSS = (_HERE / "page.css").read_text(encoding="utf-8")
# The one style the page has, allowed by its hash; no script-src: default-src 'none' forbids
# every script. img-src data: for nothing today (the sparklines are inline SVG elements).
CSP = ("default-src 'none'; style-src 'sha256-"
       + base64.b64encode(hashlib.sha256(_CSS.encode()).digest()).decode()
       + "'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# With nosniff and no-store, which every answer carries (guard_server/headers.py).
_HEADERS = {
    "Content-Security-Policy": CSP,
    "Referrer-Policy": "no-referrer",  # run ids in the URL go to no other site
}
REFRESH_S = 5  # the page reloads itself (a meta refresh: no script)

_ENV = Environment(loader=FileSystemLoader(_HERE / "templates"), autoescape=True,
                   undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
_ENV.filters["visible"] = visible  # bidi controls in a tooltip, written out (page/sizes.py)
_ENV.filters["plural"] = plural  # "1 rank", "2 ranks"
_ENV.globals["tooltip"] = TOOLTIP  # characters of a message in its tooltip


def page(template: str, *, status: int = 200, headers: dict[str, str] | None = None,
         refresh: bool = True, **context: Any) -> HTMLResponse:
    """`template` rendered with `context` (escaped), with the page's headers."""
    html = _ENV.get_template(template).render(css=_CSS, refresh=REFRESH_S if refresh else 0,
                                              **context)
    return HTMLResponse(html, status_code=status, headers={**_HEADERS, **(headers or {})})
