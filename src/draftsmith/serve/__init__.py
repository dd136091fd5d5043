"""Serving: the engine (checks a drafter, decodes requests), the OpenAI-compatible server, metrics, the memory plan.

The constants below are what ``draftsmith serve``'s flags default to; they live here, torch-free, so that the
command line can check and document its flags before anything heavy is imported.
"""

#: Default cap on a request body (``--max-request-bytes``): 8 MiB. A prompt as long as a 128k-token context is
#: about 0.5 MB of text (4 bytes a token), or 1 MB as a JSON list of token ids, 6x that at worst with every
#: character \u-escaped; 8 MiB leaves room for that and for 1M-token contexts of plain text, while a client cannot
#: make the server buffer and parse arbitrary amounts (the whole body is read before it is validated).
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
#: The environment variable ``draftsmith serve`` reads its API key from when ``--api-key`` is not given (as vLLM's
#: ``VLLM_API_KEY``).
API_KEY_ENV = "DRAFTSMITH_API_KEY"
