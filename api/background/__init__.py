"""What every API process runs beside its routes: the batch driver (``batchdriver``) and webhooks'
consumer and sender (``webhooks``), which share one way of waiting while Redis is away
(``outage``)."""
