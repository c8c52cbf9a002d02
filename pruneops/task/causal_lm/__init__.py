"""The decoder-LLM path of the pipeline stages (`train.task: causal_lm`, `validate.dataset: corpus`).

Each stage module dispatches here when its run is a causal LM's; these modules hold what that
path does (corpus blocks, adopting the model, per-layer sensitivity, the decode cost table, the
shape plan, distillation within a token budget, the precision that ships, the genai export and the
benchmark), built on the library layer (`pruneops.models.decoders`, `pruneops.pruning.decoder_cuts`,
`pruneops.planning.decode_cost`, `pruneops.runtimes.genai.generation`).
"""
