"""Llama-family model runtime: paged KV cache, tree attention, tensor parallelism.

Import from the submodules (`adaserve.model.runner`, `adaserve.model.loader`); this
package file stays empty so `import adaserve.model.config` does not pull in torch.
"""
