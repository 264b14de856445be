"""adaserve: multi-SLO LLM serving with SLO-customized speculative decoding."""

__version__ = "0.1.0"
