"""The end of every request: its one usage record, and its budget reservation settled.

``settlement`` reads what admission decided (`gateway.admission`) and what the stream relay
measured (`gateway.upstream.stream_relay`), writes the record and hands the reservation to the
ledger (`gateway.ledger`, the only code that changes a balance) to settle or release.
"""
