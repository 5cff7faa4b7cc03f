"""Not a stage: the features extract writes and train reads. Which features a run file asks for
(``layout``), the shard format (``shards``), the lazy reader that can follow an extract still
writing (``reader``), and the disk bound the two keep between them (``cache``)."""
