"""Load generation against a running OpenAI-compatible server (`adaserve bench serve`)."""

# Prompt token ids are drawn from [lo, hi): ordinary tokens, no specials. Here, not in
# loadgen, so the CLI's flag default needs no httpx import.
PROMPT_VOCAB = (1000, 20000)
