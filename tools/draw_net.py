#!/usr/bin/env python
"""Draw a graph of the net architecture (pycaffe's python/draw_net.py).

    python tools/draw_net.py INPUT_NET_PROTO_FILE OUTPUT_IMAGE_FILE
        [--rankdir LR] [--phase TRAIN|TEST|ALL] [--display_lrm]

PNG/SVG/PDF need Graphviz's ``dot``; an output ending in .dot, .gv or .raw gets the dot text.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from minicaffe.compat.draw import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
