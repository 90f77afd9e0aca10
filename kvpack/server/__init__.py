"""server — kvpack's HTTP front over one Service (aiohttp).

- app.py: the application, its one engine worker, the completion routes, health and
  metrics.
- openai.py: the OpenAI wire format (request parsing, response bodies; no I/O).
- auth.py: API keys on every request, roles per route.
- admin.py: admin routes (quarantine, GC, key rotation).
- peers.py: the routes another vault uses to import from this one.
"""
