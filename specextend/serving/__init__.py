"""Ray Serve application: OpenAI-compatible ingress -> SpecExtend replicas (target + draft actor).

settings.py validates the application arguments; app.py assembles the deployments; the ingress
(api.py) never imports torch.
"""
