"""Integrations of Parrot with other frameworks, each behind an optional extra.

:mod:`parrot.integrations.langchain` (extra ``langchain``): LangChain models over
Parrot's OpenAI API, and LCEL pipelines run as one Parrot DAG.
"""
