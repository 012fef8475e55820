"""In-memory weight transfer from trainer rank 0 to every inference worker (`weight_broadcast.type` gloo or nccl):
`protocol.py` holds the keys, requests and wire format, `store.py` the authenticated rendezvous store."""
