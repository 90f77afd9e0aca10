"""remote — vault to vault: peers, quarantine, import and export (docs/architecture.md: step 3).

- peers.py: the vaults this one may import from (a transport, never an authority).
- quarantine.py: where a peer's answer waits, sealed, while it is checked.
- importer.py: the remote tier (find a peer's offer; load = import through quarantine,
  promote into the durable tier, serve what our own store verified).
- exporter.py: this vault's own signed cuts, for its peers.
"""
