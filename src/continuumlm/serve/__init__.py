"""Serving a trained model over HTTP: ``continuumlm serve`` (OpenAI's completion API,
streamed or not, many clients decoded together, the depth chosen per request).

- :mod:`.engine`: continuous batching on the model's own thread, exact per row;
- :mod:`.request`: a request, its rows and the events it receives;
- :mod:`.protocol`: the request bodies and their checks;
- :mod:`.app`: the FastAPI application (``pip install 'continuumlm[serve]'``);
- :mod:`.server`: the command (uvicorn, draining on SIGTERM and SIGINT).

See docs/serving.md.
"""

from .engine import Engine, QueueFull
from .request import Depth, Event, Request, Sampling

__all__ = ["Depth", "Engine", "Event", "QueueFull", "Request", "Sampling"]
