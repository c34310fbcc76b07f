"""Stand-in for causal-conv1d 1.6.1 (``tests.support.mixer_standin``): ``causal_conv1d_fn`` only."""

__version__ = "1.6.1"

from causal_conv1d.causal_conv1d_interface import causal_conv1d_fn

__all__ = ["causal_conv1d_fn"]
