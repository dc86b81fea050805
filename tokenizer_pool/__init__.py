"""The tokenizer pool: a router (`router.py`) that balances tokenize /
chat-render / detokenize jobs over tokenizer worker processes
(`tokenize_worker.py`), run by `pool.py` and restarted by
`pool_supervisor.py`, used by frontends through `tokenizer_client.py`.

Scaling: workers join a router over its backend socket at any time, so
`pagedserve tokenizer --join tcp://ROUTER:5557` on other hosts (or scaled
compose containers) adds capacity to one router.
"""
