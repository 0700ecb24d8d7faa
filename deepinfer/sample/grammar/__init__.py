"""Structured output compiled into the sampler: a grammar per request, a token bitmask per step.

THE PYTHON API (what the HTTP server and users build on; docs/structured-output.md has the rest):

    from deepinfer import SamplingParams, StructuredOutputsParams
    from deepinfer.errors import StructuredOutputError

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))
    StructuredOutputsParams(regex=r"[a-z]+@[a-z]+\\.com")
    StructuredOutputsParams(grammar='start: "yes" | "no"')    # llguidance Lark syntax (default engine)
    StructuredOutputsParams(grammar='root ::= "yes" | "no"')  # XGrammar EBNF (structured_output_backend="xgrammar")
    StructuredOutputsParams(choice=["red", "green"])
    StructuredOutputsParams(json_object=True)                 # any JSON object
    StructuredOutputsParams(json=schema, whitespace="compact")  # no whitespace between JSON tokens

- `deepinfer.sampling_params.StructuredOutputsParams` (exported from `deepinfer`): exactly one of
  json (a JSON Schema dict or its JSON text), regex, grammar, choice (list[str]), json_object
  (bool) is set; `whitespace` is "flexible" (default) or "compact" (json / json_object only).
  Construction checks types and "exactly one" (StructuredOutputError naming the field).
- `SamplingParams.structured_outputs`: None or one of those. Refused together with
  ignore_eos=True or min_tokens > 0 (InvalidRequestError, param "ignore_eos" / "min_tokens").
- `deepinfer.errors.StructuredOutputError(field, message, keyword=None, path=None)`, a subclass
  of InvalidRequestError: `.param` = "structured_outputs.<field>", `.field`, `.keyword` (the JSON
  Schema keyword the engine would not enforce, e.g. "uniqueItems"), `.path` ("#/properties/x").
  Raised by the engine's `add_request` (before anything is queued) for: a keyword the engine
  would not enforce (fail closed: never silently dropped), a syntax error in a regex / grammar /
  schema, a compile over `EngineConfig.structured_output_compile_timeout_s` (default 10 s), a
  spec over `EngineConfig.structured_output_max_bytes` (default 256 KiB) or a grammar over the
  engine's size limit. The server turns it into a 400 naming `param` and the keyword.
- The engine: `EngineConfig.structured_output_backend` = "llguidance" (default) | "xgrammar"
  (`--structured-output-backend`); grammar syntax follows the engine (see above).
- Output: a structured request's text is produced under the mask every step; it ends with EOS
  once the grammar is complete (EOS is allowed only then), or by max_tokens / a stop string /
  max_model_len (then the text is a prefix of a valid output: finish_reason "length" / "stop").
  Logprobs are those of the MASKED distribution (tokens the grammar forbids have -inf).

The room: `backend.py` (the engine-neutral GrammarBackend / GrammarMatcher interface and the
tokenizer facts both engines need), `llguidance_engine.py` and `xgrammar_engine.py` (the two
engines), `schema_keywords.py` (the fail-closed keyword check), `compiler.py` (the compiled-grammar
cache, the compile timeout and the size limits), `matcher_state.py` (a sequence's matcher, fed
with its output tokens lazily, rolled back on demand), `bitmask.py` (the host fill of a batch's
bitmask), `draft_mask.py` (speculative decoding: drafts cut at the first forbidden token, a mask
per verified position, one batched fill). The bitmask is applied on the device by the backend op
`Backend.apply_token_bitmask`.
"""

from deepinfer.sample.grammar.backend import GrammarBackend, GrammarMatcher, TokenizerFacts
from deepinfer.sample.grammar.compiler import GRAMMAR_BACKENDS, GrammarCompiler
from deepinfer.sample.grammar.matcher_state import SeqGrammar

__all__ = ["GRAMMAR_BACKENDS", "GrammarBackend", "GrammarCompiler", "GrammarMatcher", "SeqGrammar", "TokenizerFacts"]
