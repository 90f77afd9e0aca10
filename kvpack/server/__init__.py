"""server — kvpack's HTTP front over one Service (aiohttp).

- app.py: the application, its engine scheduler, the completion routes, liveness,
  readiness and metrics.
- openai.py: the OpenAI wire format (request parsing, response bodies; no I/O).
- errors.py: ApiError, the refusal every route answers with (never a 5xx on bad input).
- fields.py: typed checks of body fields, ids and JSON depth.
- bodies.py: reading a body within a size limit, and parsing it off the event loop.
- auth.py: API keys on every request, roles per route.
- admin.py: admin routes (quarantine, GC, key rotation).
- peers.py: the routes another vault uses to import from this one.
"""
