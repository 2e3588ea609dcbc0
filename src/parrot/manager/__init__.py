"""The Parrot manager: sessions, the dataflow graph of calls and variables,
and the executor that runs calls on engines.  Never imports torch or engine
internals; engines are reached through the engine API only."""
