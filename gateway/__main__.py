"""``python -m gateway``: run the OpenAI-compatible gateway (see :mod:`gateway.app`)."""

from gateway.app import main

if __name__ == "__main__":
    main()
