"""Stage plumbing of realtime sessions: what a session sends to the stages and what comes back.

* :mod:`.events` — the events a pipeline reports, the pipeline interface a session drives
  (:class:`~.events.SessionPipeline`) and the read-only view of the session a pipeline gets
  (:class:`~.events.PipelineHost`). Imports nothing of the session, so the session can import it.
* :mod:`.duplex` — :class:`~.duplex.GrpcDuplexPipeline`: the thinker's duplex stream of one session.
* :mod:`.speech` — :class:`~.speech.SpeechTurn`: the talker + code2wav streams of one speaking turn.
"""
