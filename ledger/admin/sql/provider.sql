-- The catalog markers doctor tells a managed service by
-- (docs/managed-postgres.md). Every statement only reads.

-- name: ProviderSettings
-- The settings whose names match one of the patterns $1 or are among $2.
SELECT coalesce(array_agg(name ORDER BY name), '{}') FROM (
  SELECT name FROM pg_settings WHERE name LIKE ANY ($1)
  UNION
  SELECT n FROM unnest($2::text[]) AS n WHERE current_setting(n, true) IS NOT NULL) AS s;

-- name: ProviderRoles
-- The roles among $1 that exist.
SELECT coalesce(array_agg(rolname::text ORDER BY rolname), '{}') FROM pg_roles WHERE rolname = ANY ($1);

-- name: ProviderAuroraVersion
SELECT to_regproc('aurora_version') IS NOT NULL;
