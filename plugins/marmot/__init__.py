"""Marmot notification-server plugin (spec: ``specs/marmot.md``).

Protocol layer (pure, no I/O):

* :mod:`plugins.marmot.nip44` - NIP-44 v2 with the 2026 extended length prefix.
* :mod:`plugins.marmot.nostr` - NIP-01 events, BIP-340, NIP-59 unwrap (receiver checks 1-8).
* :mod:`plugins.marmot.trigger` - kind-446 trigger profile selection and content parsing (check 9).
* :mod:`plugins.marmot.tokens` - encrypted device tokens (check 11, crypto and plaintext checks).
* :mod:`plugins.marmot.keys` - server key handling, key generation, NIP-19 bech32.
* :mod:`plugins.marmot.errors` - typed drop / skip reasons.
"""
