"""The bench's peers under their earlier module path; they live in loopspec.runtime.bench.peers."""

from loopspec.runtime.bench.peers import (HF_METHODS, LLAMACPP_METHODS, PEER_BACKENDS, PEER_METHODS,  # noqa: F401
                                          PLAIN_PEER, HFPeer, LlamaServerPeer, PeerRun, free_port, stop)
