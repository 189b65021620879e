"""The review page `proctor serve` shows at /review (DESIGN.md 9): the same verbs as `proctor jobs|show|
diff|land|discard` (proctor.services.review), for a person at a browser.

    access   who may use it: this install's token, a session cookie, the CSRF token of every form
    views    what a page shows, as data (badges, the verdict, which verbs are offered)
    patch    the diff, split by file and highlighted, every agent byte escaped and every cut said
    app      the routes, the security headers, the live stream (server-sent events)

Templates and assets are package data: nothing is fetched from anywhere else.
"""
