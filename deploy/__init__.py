"""Serve entry points: `serve run deploy.app:specextend [key=value ...]`."""
