"""Shared library of splitserve: configs, wire types, codec, channels, launcher and CLI.

Never imports a `*_svc` package.
"""
