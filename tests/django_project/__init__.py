"""A minimal Django project on PostgreSQL (``shop``, with an ``orders`` app) whose view
creates an Order and starts a saga in one ``transaction.atomic()`` block: the project the
Django integration tests drive. Its one database is the journal's (``SHOP_DATABASE_URL``)."""
