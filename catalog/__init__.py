"""catalog — facts: identities, manifests, chunk refs, quarantine, economics ledger."""
