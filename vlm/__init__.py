"""Vision-language models on the shared decoding core (transformers adapters, token dropping).

Reserved namespace: nothing ships here yet (see the issue tracker)."""
