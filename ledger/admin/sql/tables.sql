-- The relay's tables as the server finds them.

-- name: TableSchema
-- The schema the search_path finds the table $1 (a quoted name) in; no row
-- when it does not exist.
SELECT ns.nspname FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
 WHERE c.oid = to_regclass($1);
