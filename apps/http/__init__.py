"""The pieces of `mmgen serve` (`mmgen.apps.server`) that are about HTTP, not models: the OpenAI
error format (`errors`), request bodies (`bodies`), admission (`admission`), what responses
encode (`encoders`), OpenAI chat messages (`chat`), the guard in front of every route
(`guard`), connection limits and timeouts (`connections`) and the server's settings (`settings`).
"""
