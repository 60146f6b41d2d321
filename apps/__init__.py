"""Gradio demo apps built on the pipelines (`mmgen demo ...`).

`image_demo` serves the class-conditional image pipelines with every decoding method of the
core's registries; `image_request` is its UI-free request function. The core never imports
this package.
"""
