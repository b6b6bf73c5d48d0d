"""batchq's producer side, in four rooms: wire (the contract, Redis keys and store both sides share; the
worker imports this room only), client (BatchqClient), cli (`producer`) and api (`producer serve`).
Imports no torch."""
