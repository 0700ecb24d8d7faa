"""Exception types that name the problem; every user-facing failure raises one of these."""


class DeepInferError(Exception):
    """Base class of every error DeepInfer raises on purpose."""


class ConfigError(DeepInferError, ValueError):
    """An engine setting or environment variable has a bad value."""


class ModelLoadError(DeepInferError):
    """The model directory, its config.json or its weights cannot be used."""


class UnsupportedModelError(ModelLoadError):
    """config.json names a model_type or variant DeepInfer does not run."""


class BackendError(DeepInferError):
    """No usable backend, an unknown device name, or a feature the backend cannot honour."""


class InvalidRequestError(DeepInferError, ValueError):
    """A request (prompt or sampling parameters) is invalid; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class StructuredOutputError(InvalidRequestError):
    """A structured-output constraint (SamplingParams.structured_outputs) cannot be enforced as asked.

    `field` names the StructuredOutputsParams field ("json", "regex", "grammar", "choice",
    "json_object", "whitespace"); `param` is "structured_outputs.<field>" (what a 400 names).
    `keyword` is the JSON Schema keyword the engine would not enforce (None for other problems:
    a syntax error, the compile timeout, the size limit), `path` where it sits in the schema
    (a JSON pointer such as "#/properties/tags"). Raised by StructuredOutputsParams' own checks
    and by the engine's add_request, before anything is queued: never a silently dropped keyword.
    """

    def __init__(self, field: str, message: str, keyword: str | None = None, path: str | None = None):
        super().__init__(message, param=f"structured_outputs.{field}")
        self.field = field
        self.keyword = keyword
        self.path = path


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus requested tokens) does not fit in max_model_len."""


class UnsupportedOpError(BackendError):
    """A backend does not implement an op for these inputs (dtype, shape, variant).

    The conformance suite reports it as coverage ("unsupported" with this message), not as a failure.
    """
