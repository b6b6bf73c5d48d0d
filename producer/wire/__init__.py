"""The wire and storage library both sides share: the request/result contract, every Redis key, the batch
store's Lua scripts, the job (de)serialisers, Redis URLs, the result cache's keys, and what workers publish.
The worker imports this room of the producer and no other."""
