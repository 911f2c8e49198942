"""Experimental options for collectives (TF: ``tf.distribute.experimental``)."""

from ._src.options import CommunicationImplementation as CommunicationImplementation
from ._src.options import CommunicationOptions as CommunicationOptions

__all__ = ["CommunicationImplementation", "CommunicationOptions"]
