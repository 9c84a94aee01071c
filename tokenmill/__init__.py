"""tokenmill: an LLM inference engine and OpenAI-compatible server on PyTorch."""
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.lora.request import LoRARequest

__version__ = "0.1.0"
__all__ = ["LLM", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "LoRARequest",
           "__version__"]


def __getattr__(name):
    # Import the engine lazily so `import tokenmill` (CLI --help, the scheduler tests) stays light.
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    if name == "EngineArgs":
        from tokenmill.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(name)
