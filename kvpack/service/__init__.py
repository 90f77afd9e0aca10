"""service — one model serving its tenants through the ladder (the door every API uses).

- service.py: Service (complete: ladder, prefill, decode), CompletionRequest, Completion.
- publication.py: which cuts a cold prefill publishes, and where.
- detok.py: generated ids to text, stop strings.
"""
