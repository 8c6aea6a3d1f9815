"""Starting kvharbor: the `kvharbor` command's dispatch (cli), the local platform (up), an
embedded Redis for machines without one (embedded_redis) and the load test's tenants
(loadtest_tenants). Nothing else imports this package at run time."""
