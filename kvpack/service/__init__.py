"""service — one model serving its tenants through the ladder (the door every API uses).

- service.py: Service (complete: ladder, prefill, decode; steps: the same one engine
  step at a time), CompletionRequest, Completion.
- scheduler.py: the engine thread, round-robin between tenants one step at a time.
- publication.py: which cuts a cold prefill publishes, and where.
- detok.py: generated ids to text, stop strings.
"""
