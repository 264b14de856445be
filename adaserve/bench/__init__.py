"""Load generation against a running OpenAI-compatible server (`adaserve bench serve`)."""
