"""Training the embedded default pair: corpus, tokenizer, target, export.

Each stage is a command (`python -m ddserve.train.<stage>`); `README.md` here lists them and the
exact device commands. The modules a device run imports (`shapes`, `data`, `target_model`,
`target`, `export`) need only torch, numpy, tokenizers and safetensors, plus the ddserve modules
that import only those (`ddserve.config`, `ddserve.model.rope`, `ddserve.model.quant`).
"""
