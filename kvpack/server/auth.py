"""Who is asking: bearer API keys on every request (an aiohttp middleware).

Words (keys, roles, principals: catalog/access.py):
- authenticator: a blocking callable token -> Principal | None. `catalog_authenticator`
  asks the catalog on every request (off the event loop), so a revocation holds from the
  next request on; an unreachable catalog refuses (503), it never lets a caller through.
  With the vault's catalog breaker it refuses at once while the catalog is known down,
  instead of waiting out the catalog timeout on every request.
- route class: which roles a path admits. /healthz and /readyz are open (/healthz shows
  activity only when an admin key comes along: `optional_principal`); /v1/admin/...,
  /metrics, /v1/economics and the status page / are admin only (they show every tenant);
  /v1/peer/... is for peer and admin keys; everything else (completions, models) for any
  valid key. A browser may send the key of the status page as a Basic auth password.
- admin keys are global: their namespace is "*" (catalog/access.py refuses any other).
- completion namespace: where a principal's completions live: a key's own namespace, or
  the front's default namespace for a "*" (peer or admin) key.
- anonymous: no authenticator at all (in-process tests, `kvpack serve --no-auth` on a
  loopback address): every request is ANONYMOUS, an admin of every namespace.

Refusals are ApiErrors, so the app's openai_errors middleware (kvpack/server/app.py,
outside this one) renders them as OpenAI error bodies: 401 (code invalid_api_key,
WWW-Authenticate: Bearer) for a missing, unknown, wrong or revoked key, 403 for a role
the route refuses.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import hdrs, web
from aiohttp.typedefs import Middleware
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from cas.breaker import Breaker
from catalog import access
from catalog.access import ALL_NAMESPACES, ROLES, Principal
from catalog.db import UNREACHABLE, Reader
from kvpack.server.errors import ApiError

Authenticator = Callable[[str], Principal | None]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PRINCIPAL = web.RequestKey("principal", Principal)
ANONYMOUS = Principal(key_id="anonymous", role="admin", namespace=ALL_NAMESPACES)
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
ADMIN_PATHS = frozenset({"/metrics", "/v1/economics", "/"})
BROWSER_PATHS = frozenset({"/"})  # a browser asks for Basic credentials: the key as password


@dataclass(frozen=True)
class KeyCheck:
    """The app's authenticator (None: anonymous), for routes that read a key themselves."""

    authenticate: Authenticator | None


AUTHENTICATOR = web.AppKey("key_check", KeyCheck)


def allowed_roles(path: str) -> tuple[str, ...]:
    """The roles that may use `path` (empty: open to anyone, no key needed)."""
    if path in OPEN_PATHS:
        return ()
    if path in ADMIN_PATHS or _under(path, "/v1/admin"):
        return ("admin",)
    if _under(path, "/v1/peer"):
        return ("peer", "admin")
    return ROLES


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive)."""
    scheme, _, token = (header or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def basic_password(header: str | None) -> str | None:
    """The password of an `Authorization: Basic ...` header (a browser's way to send the
    key: any user name, the key as the password)."""
    scheme, _, encoded = (header or "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        _, _, password = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return password or None


def completion_namespace(principal: Principal, default: str) -> str:
    return default if principal.namespace == ALL_NAMESPACES else principal.namespace


def catalog_authenticator(db: Engine, *, breaker: Breaker | None = None) -> Authenticator:
    """Look every token up in the catalog's api_keys (blocking: run it off the loop).
    `breaker` (the vault's catalog breaker) skips a catalog known to be down."""
    message = "the API key could not be checked: the catalog is unreachable"
    read = Reader(db)

    def authenticate(token: str) -> Principal | None:
        if breaker is not None and not breaker.allow():
            retry = max(1, round(breaker.state().retry_in_s))
            raise ApiError(
                503, message, code="auth_unavailable", headers={"Retry-After": str(retry)}
            )
        try:
            principal = read(lambda s: access.authenticate(session=s, token=token))
        except SQLAlchemyError as e:  # fail closed: no answer is no access
            if breaker is not None and isinstance(e, UNREACHABLE):
                breaker.failure()
            raise ApiError(503, message, code="auth_unavailable") from e
        if breaker is not None:
            breaker.success()
        return principal

    return authenticate


async def optional_principal(request: web.Request) -> Principal | None:
    """The principal of the request's key on an open route; None without a valid key
    (an open route never refuses, it only shows less)."""
    authenticate = request.app[AUTHENTICATOR].authenticate
    if authenticate is None:
        return ANONYMOUS
    token = bearer_token(request.headers.get(hdrs.AUTHORIZATION))
    if token is None:
        return None
    try:
        return await asyncio.to_thread(authenticate, token)
    except ApiError:
        return None


def any_active_key(db: Engine) -> bool:
    """Whether the catalog holds an unrevoked key (with none, every caller is refused)."""
    with Session(db) as session, session.begin():
        return access.any_active_key(session=session)


def unauthorized(message: str, *, browser: bool = False) -> ApiError:
    challenge = 'Basic realm="kvpack", charset="UTF-8"' if browser else "Bearer"
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": challenge})


def middleware(authenticate: Authenticator | None) -> Middleware:
    """The middleware that sets request[PRINCIPAL] or refuses; None: anonymous access."""

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if authenticate is None:
            request[PRINCIPAL] = ANONYMOUS
            return await handler(request)
        roles = allowed_roles(request.path)
        if not roles:
            return await handler(request)
        header = request.headers.get(hdrs.AUTHORIZATION)
        browser = request.path in BROWSER_PATHS
        token = bearer_token(header) or (basic_password(header) if browser else None)
        if token is None:
            raise unauthorized("no API key: send Authorization: Bearer <key>", browser=browser)
        principal = await asyncio.to_thread(authenticate, token)
        if principal is None:  # unknown, wrong secret or revoked: the caller is not told which
            raise unauthorized("the API key is not valid", browser=browser)
        if principal.role not in roles:
            needs = " or ".join(roles)
            message = f"{request.path} is for {needs} keys; this is a {principal.role} key"
            raise ApiError(403, message, code="permission_denied")
        request[PRINCIPAL] = principal
        return await handler(request)

    return auth
