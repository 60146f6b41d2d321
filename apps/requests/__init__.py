"""The request layer every user surface shares (the Gradio demos, `mmgen serve`): one set of
input limits and checks (`bounds`), a catalogue of loaded pipelines and their shared
continuous-batching servers per modality (`catalog`), runs and results compared per output unit
and the streaming plumbing with one rule for a client that goes away (`runs`), and a module per
modality of `mmgen.registry.MODALITIES`, named for it (`vlm` is `text`'s old name), that checks
its request and runs it, registered once as that modality's `ModalityService` (`service`: the
contract every surface reads them through).

Importing it needs neither gradio nor diffusers: the surfaces import what they draw with.
"""
