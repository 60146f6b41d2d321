"""The user surfaces built on the pipelines: the Gradio demos (`mmgen demo ...`) and the HTTP
server (`mmgen serve`), all on one request layer (`requests`: inputs checked and bounded,
catalogues of loaded models, runs streamed and compared per output unit). The core never
imports this package.
"""
