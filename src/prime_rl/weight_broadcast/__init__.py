"""In-memory weight transfer from trainer rank 0 to every inference worker (`weight_broadcast.type` gloo or nccl):
`protocol.py` holds the keys, requests and wire format of a transfer; `store.py` the authenticated rendezvous store
(server side), `client.py` its client and the `dist.Store` adapter groups meet through, `wire.py` their framing."""
