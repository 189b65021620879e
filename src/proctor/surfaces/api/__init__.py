"""The HTTP surface: `proctor serve`, a FastAPI app over the same queue services the CLI uses.

Owns routes and status codes only; the signed envelope is the authentication, checked by the queue code.
"""
