"""Text generation on shoal's own decoder forwards (issue 39; the first part: decoding).

    kv_cache.SlabCache   ─ one slot of max_len positions per sequence, under a byte budget
    forward.CachedDecoder ─ a step over a packed batch of new tokens of many sequences: each
                            sequence's keys and values go into its slot, attention reads the slot
    sampling             ─ greedy, or seeded temperature / top-p per sequence
    batcher.Generator    ─ continuous batching: sequences join (prefill) and leave (eos, max_new_tokens,
                           stop strings, deadline, cancel) between decode steps

Not yet here: grammar constraints, the extract kind, /v1/chat/completions (see docs/generate.md).
"""
